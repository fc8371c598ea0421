# kvcoll on Debian with Python 3.11: ./dev builds the venv and the C extension.
#   docker build -t kvcoll . && docker run --rm kvcoll            (2-rank DeepFM demo)
#   docker run --rm kvcoll ./dev test                              (the test suite)
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /kvcoll
COPY . .
RUN ./dev build
CMD ["./dev", "demo"]
