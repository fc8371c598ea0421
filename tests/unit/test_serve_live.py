"""kvcoll serve following a training job (--poll-ms 100):

- the versions published by a second fit are applied live, and the server then
  predicts what model.predict predicts at that version (1e-5), over gRPC;
- a corrupt delta (a page failing its sha256) is refused: the reason is in the status
  and the log, the refusal in the metrics, and the last good version keeps serving;
- a restarted server loads the newest base and replays the deltas after it.
The 30 s load test (8 clients while deltas apply) is tests/serve/, run by
./dev serve-tests.
"""

import json
import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow_serving.apis import prediction_service_pb2_grpc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_process import serving  # noqa: E402
from test_publish_keras import data, trained  # noqa: E402
from test_serve import grpc_request, rest  # noqa: E402

from kvcoll.publish import read_latest, version_dir  # noqa: E402


def wait_for(fn, timeout=60.0, what="a condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def status(srv):
    return rest(srv.rest, "/v1/models/model")[1]["kvcoll"]


def test_live_deltas_corrupt_delta_and_restart(tmp_path):
    d = str(tmp_path / "pub")
    model, cb = trained(d, every_n_steps=2, base_every=3)
    feeds, _ = data(16, 5)
    x, y = data(256, 2)
    with serving(d, "--poll-ms", "100") as srv:
        assert srv.version == 4
        stub = prediction_service_pb2_grpc.PredictionServiceStub(
            grpc.insecure_channel(srv.grpc))
        model.fit(x, y, batch_size=32, epochs=1, callbacks=[cb], verbose=0)  # versions 5-8
        assert read_latest(d) == 8
        want = model.predict(feeds, verbose=0)
        wait_for(lambda: status(srv)["version"] == 8, what="version 8 served")
        resp = stub.Predict(grpc_request(feeds), timeout=30)
        assert resp.model_spec.version.value == 8
        np.testing.assert_allclose(tf.make_ndarray(resp.outputs["prediction"]), want,
                                   rtol=0, atol=1e-5)
        st = status(srv)
        assert st["applied"] == 4 and st["refused"] == []
        # version 9: a copy of delta 8 (its parent made 8), one byte of a page flipped
        src, dst = os.path.join(d, version_dir("delta", 8)), os.path.join(d, "incoming")
        shutil.copytree(src, dst)
        man = json.load(open(os.path.join(dst, "manifest.json")))
        man.update(model_version=9, parent=8)
        json.dump(man, open(os.path.join(dst, "manifest.json"), "w"))
        shard = os.path.join(dst, sorted(f for f in os.listdir(dst) if f.endswith(".kvs"))[-1])
        raw = bytearray(open(shard, "rb").read())
        raw[9] ^= 0x40
        open(shard, "wb").write(bytes(raw))
        os.rename(dst, os.path.join(d, version_dir("delta", 9)))
        open(os.path.join(d, "latest"), "w").write("9\n")
        st = wait_for(lambda: (lambda s: s if s["refused"] else None)(status(srv)),
                      what="the corrupt delta refused")
        assert st["version"] == 8
        assert st["refused"][0]["version"] == 9 and "sha256" in st["refused"][0]["reason"]
        assert "version 9 refused" in "".join(srv.log)
        def metrics():
            with urllib.request.urlopen(srv.rest + "/metrics", timeout=30) as r:
                return r.read().decode()
        text = wait_for(lambda: (lambda t: t if "refused_total 1.0" in t else None)(metrics()),
                        what="the refusal in the metrics")
        assert "kvcoll_serve_deltas_refused_total 1.0" in text
        assert "kvcoll_serve_deltas_applied_total 4.0" in text
        resp = stub.Predict(grpc_request(feeds), timeout=30)  # still version 8
        assert resp.model_spec.version.value == 8
        np.testing.assert_allclose(tf.make_ndarray(resp.outputs["prediction"]), want,
                                   rtol=0, atol=1e-5)
    # a restart: the newest base (7) and delta 8 (the corrupt 9 is refused at load too)
    shutil.rmtree(os.path.join(d, version_dir("delta", 9)))
    open(os.path.join(d, "latest"), "w").write("8\n")
    with serving(d, "--poll-ms", "0") as srv:
        assert srv.version == 8
        assert any("loading base 7" in line for line in srv.log)
        code, body = rest(srv.rest, "/v1/models/model:predict",
                          {"inputs": {k: (v.astype(str) if v.dtype == object else v).tolist()
                                      for k, v in feeds.items()}})
        assert code == 200
        np.testing.assert_allclose(np.array(body["outputs"]), want, rtol=0, atol=1e-5)
