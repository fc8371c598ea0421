# kvcoll on Debian with Python 3.11: builds the venv and the C extension, runs the demo.
#   docker build -t kvcoll . && docker run --rm kvcoll            (2-rank demo)
#   docker run --rm kvcoll ./dev test                              (the test suite)
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /kvcoll
COPY requirements.txt ./
RUN python -m venv .venv && .venv/bin/pip install --no-cache-dir -r requirements.txt \
    && sha256sum requirements.txt | cut -d' ' -f1 > .venv/.kvcoll-requirements
COPY . .
RUN ./dev build
CMD ["./dev", "demo"]
