"""The serving process: TensorFlow Serving's gRPC API (grpc.aio) and REST API (aiohttp)
on one asyncio loop, a batcher that merges concurrent requests, worker threads that run
the merged batches, and Prometheus metrics.

gRPC: tensorflow.serving.PredictionService/Predict and GetModelMetadata (the protos of
tensorflow-serving-api). REST: POST /v1/models/<name>[/versions/<v>]:predict (the
"instances" and "inputs" forms), GET /v1/models/<name> (the version served, TF
Serving's status JSON plus a "kvcoll" object: step, freshness, rows, deltas applied
and refused with their reasons), GET /v1/models/<name>/metadata, GET /metrics (and
/monitoring/prometheus/metrics) for Prometheus (with the pauses of Python's full
collections: see kvcoll.serve.heap).

Batching: a request is checked on the loop (a bad one is answered at once), then
queued; a batcher takes the queued requests up to `batch_rows` samples, waiting at
most `batch_wait` seconds for more after the first, merges them and hands the batch to
one of `workers` threads (the C lookups and TensorFlow release the GIL, so they run in
parallel); each request gets its own slice of the outputs. Every request of a merged
batch sees the one version the batch pinned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import time

import numpy as np

from .heap import Pauses, settle
from .requests import BadRequest, from_json, merge, to_json

__all__ = ["Server"]

log = logging.getLogger("kvcoll.serve")


# fine enough to tell which stage moves a p99 of a few milliseconds
STAGE_BUCKETS = (.00025, .0005, .00075, .001, .0015, .002, .003, .004, .005, .0075, .01,
                 .015, .02, .05, .1, .5, 2)


class _Metrics:
    def __init__(self, model):
        import prometheus_client as pc

        self.registry = reg = pc.CollectorRegistry()
        self.version = pc.Gauge("kvcoll_serve_version", "the model version served",
                                registry=reg)
        self.freshness = pc.Gauge("kvcoll_serve_freshness_seconds",
                                  "now minus the wall time of the training step the served "
                                  "version holds", registry=reg)
        self.rows = pc.Gauge("kvcoll_serve_rows", "rows held per table", ["table"],
                             registry=reg)
        self.latency = pc.Histogram(
            "kvcoll_serve_request_seconds", "request latency (arrival to response)", ["api"],
            buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5),
            registry=reg)
        self.stage = pc.Histogram(
            "kvcoll_serve_stage_seconds", "where a request's time goes on the server: "
            "queue (per request: from its arrival at the batcher to its merged batch "
            "starting); per merged batch: dispatch (handing it to a worker thread and the "
            "result back), predict (on the worker), and predict's parts lookup (the ids' "
            "rows) and graph (the serving graph); the rest of kvcoll_serve_request_seconds "
            "is decoding and encoding", ["stage"],
            buckets=STAGE_BUCKETS, registry=reg)
        self.requests = pc.Counter("kvcoll_serve_requests", "requests by outcome",
                                   ["api", "code"], registry=reg)
        self.batch = pc.Histogram("kvcoll_serve_batch_samples", "samples per merged batch",
                                  buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
                                  registry=reg)
        self.applied = pc.Counter("kvcoll_serve_deltas_applied", "deltas applied",
                                  registry=reg)
        self.refused = pc.Counter("kvcoll_serve_deltas_refused", "versions refused",
                                  registry=reg)
        gc_pause = pc.Histogram(
            "kvcoll_serve_gc_pause_seconds", "full collections of Python's cycle collector "
            "(no request is answered meanwhile)",
            buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1), registry=reg)
        self.gc_frozen = pc.Gauge("kvcoll_serve_gc_frozen_objects", "objects loaded at start "
                                  "and kept out of the collector's reach", registry=reg)
        self.gc_frozen.set_function(gc.get_freeze_count)
        self.gc_pause = gc_pause
        self.pauses = None            # (counted from the end of Server.start)
        self.model = model
        self.version.set_function(lambda: model.version)
        self.freshness.set_function(lambda: model.status()["freshness_s"])

    def render(self) -> bytes:
        import prometheus_client as pc

        for name, t in self.model.tables.items():
            self.rows.labels(name).set(len(t))
        return pc.generate_latest(self.registry)


class _Batcher:
    def __init__(self, model, batch_rows: int, batch_wait: float, workers: int, metrics):
        self.model = model
        self.batch_rows, self.batch_wait = int(batch_rows), float(batch_wait)
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, "kvcoll-serve")
        self.queue: asyncio.Queue = asyncio.Queue()
        self.slots = asyncio.Semaphore(workers)
        self.metrics = metrics
        self.task = None

    def start(self):
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, batch):
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((batch, fut, time.perf_counter()))
        return await fut

    async def _run(self):
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            items, rows = [first], first[0].n
            deadline = loop.time() + self.batch_wait
            while rows < self.batch_rows:
                try:
                    item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self.queue.get(), left)
                    except asyncio.TimeoutError:
                        break
                items.append(item)
                rows += item[0].n
            await self.slots.acquire()
            loop.create_task(self._run_batch(items))

    async def _run_batch(self, items):
        loop = asyncio.get_running_loop()
        stage = self.metrics.stage
        try:
            t0 = time.perf_counter()
            for _, _, arrived in items:
                stage.labels("queue").observe(t0 - arrived)
            merged, bounds = merge([b for b, _, _ in items])
            self.metrics.batch.observe(merged.n)
            took, spent = [], {}

            def predict():
                t = time.perf_counter()
                try:
                    return self.model.predict(merged, spent)
                finally:
                    took.append(time.perf_counter() - t)
            try:
                out, version = await loop.run_in_executor(self.pool, predict)
            except Exception as exc:  # noqa: BLE001 - every waiting request learns of it
                for _, fut, _ in items:
                    if not fut.done():
                        fut.set_exception(exc)
                return
            finally:
                for part, seconds in spent.items():
                    stage.labels(part).observe(seconds)
                if took:
                    stage.labels("predict").observe(took[0])
                    stage.labels("dispatch").observe(time.perf_counter() - t0 - took[0])
            for (_, fut, _), (s, e) in zip(items, bounds):
                if not fut.done():
                    fut.set_result(({k: v[s:e] for k, v in out.items()}, version))
        finally:
            self.slots.release()

    def close(self):
        if self.task is not None:
            self.task.cancel()
        self.pool.shutdown(wait=True)


class Server:
    """kvcoll serve in this process: `await start()`, then `await stop()`.

    model: a ServedModel. host, grpc_port, rest_port: where to listen (port 0: any free
    port; `grpc_port` / `rest_port` hold the ports bound once started; None: that API
    off). batch_rows, batch_wait, workers: the batcher's settings (see the module).
    start() ends by freezing what the process holds out of Python's cycle collector
    (kvcoll.serve.heap): a Server owns its process."""

    def __init__(self, model, *, host: str = "127.0.0.1", grpc_port: int | None = 8500,
                 rest_port: int | None = 8501, batch_rows: int = 256,
                 batch_wait: float = 0.002, workers: int = 2):
        self.model = model
        self.host = host
        self.grpc_port, self.rest_port = grpc_port, rest_port
        self.metrics = _Metrics(model)
        self._settings = (batch_rows, batch_wait, workers)
        self._grpc = None
        self._runner = None
        self._applier = None
        self.batcher = None

    async def start(self) -> None:
        self.batcher = _Batcher(self.model, *self._settings, metrics=self.metrics)
        self.batcher.start()
        if self.rest_port is not None:
            await self._start_rest()
        if self.grpc_port is not None:
            await self._start_grpc()
        settle()                # everything is loaded: out of the collector's reach
        self.metrics.pauses = Pauses(self.metrics.gc_pause.observe)

    async def stop(self) -> None:
        if self._applier is not None:  # an apply under way finishes first
            await asyncio.get_running_loop().run_in_executor(
                None, self._applier.shutdown, True)
        if self._grpc is not None:
            await self._grpc.stop(0.5)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.batcher is not None:
            self.batcher.close()
        if self.metrics.pauses is not None:
            self.metrics.pauses.close()

    async def follow(self, poll: float) -> None:
        """Apply new versions as they are published: the model's poll every `poll`
        seconds, on a thread of its own (requests go on meanwhile)."""
        loop = asyncio.get_running_loop()
        pool = self._applier = concurrent.futures.ThreadPoolExecutor(1, "kvcoll-apply")
        try:
            while True:
                try:
                    got = await loop.run_in_executor(pool, self.model.poll)
                    if got["applied"]:
                        self.metrics.applied.inc(got["applied"])
                    if got["refused"]:
                        self.metrics.refused.inc(len(got["refused"]))
                except Exception:  # noqa: BLE001 - keep serving the last good version
                    log.exception("kvcoll serve: looking for new versions failed")
                await asyncio.sleep(poll)
        finally:
            pool.shutdown(wait=False)  # stop() waits for an apply under way

    async def predict(self, arrays: dict, api: str):
        """Check, batch and run one request: (outputs, version)."""
        batch = self.model.sig.check(arrays)
        return await self.batcher.submit(batch)

    # -- REST ------------------------------------------------------------------------

    async def _start_rest(self):
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/models/{tail:.+}", self._rest_predict)
        app.router.add_get("/v1/models/{name}", self._rest_status)
        app.router.add_get("/v1/models/{name}/versions/{v}", self._rest_status)
        app.router.add_get("/v1/models/{name}/metadata", self._rest_metadata)
        app.router.add_get("/metrics", self._rest_metrics)
        app.router.add_get("/monitoring/prometheus/metrics", self._rest_metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.rest_port)
        await site.start()
        self.rest_port = site._server.sockets[0].getsockname()[1]

    def _json_error(self, status: int, msg: str):
        from aiohttp import web

        return web.json_response({"error": msg}, status=status)

    def _check_name(self, name: str):
        if name != self.model.name:
            return f"Servable not found for request: Latest({name}); this server serves " \
                   f"model {self.model.name!r}"
        return None

    async def _rest_predict(self, request):
        t0 = time.perf_counter()
        code = 200
        try:
            tail = request.match_info["tail"]
            name, _, verb = tail.rpartition(":")
            parts = name.split("/")
            if verb != "predict" or not parts or (len(parts) not in (1, 3)) or \
                    (len(parts) == 3 and parts[1] != "versions"):
                code = 404
                return self._json_error(404, f"unknown path /v1/models/{tail}; use "
                                        "/v1/models/<name>[/versions/<v>]:predict")
            err = self._check_name(parts[0])
            if err:
                code = 404
                return self._json_error(404, err)
            try:
                body = await request.json(loads=_loads)
            except ValueError as exc:
                raise BadRequest(f"the request body is not valid JSON ({exc})") from None
            arrays, form = from_json(body, self.model.sig)
            # (a /versions/<v> path is served by the newest version, as TF Serving's
            # Latest: the version moves on by itself; X-Kvcoll-Version says which)
            out, version = await self.predict(arrays, "rest")
            from aiohttp import web

            return web.json_response(to_json(out, form, self.model.sig),
                                     headers={"X-Kvcoll-Version": str(version)})
        except BadRequest as exc:
            code = 400
            return self._json_error(400, str(exc))
        except Exception as exc:  # noqa: BLE001 - the server keeps serving
            code = 500
            log.exception("kvcoll serve: a REST request failed")
            return self._json_error(500, f"{type(exc).__name__}: {exc}")
        finally:
            self.metrics.latency.labels("rest").observe(time.perf_counter() - t0)
            self.metrics.requests.labels("rest", str(code)).inc()

    async def _rest_status(self, request):
        from aiohttp import web

        err = self._check_name(request.match_info["name"])
        if err:
            return self._json_error(404, err)
        st = self.model.status()
        pauses = self.metrics.pauses
        st.update(gc_pauses=pauses.count if pauses else 0,
                  gc_pause_ms_max=1000.0 * pauses.longest if pauses else 0.0,
                  gc_frozen_objects=gc.get_freeze_count())
        return web.json_response({
            "model_version_status": [{"version": str(st["version"]), "state": "AVAILABLE",
                                      "status": {"error_code": "OK", "error_message": ""}}],
            "kvcoll": st})

    async def _rest_metadata(self, request):
        from aiohttp import web

        err = self._check_name(request.match_info["name"])
        if err:
            return self._json_error(404, err)
        from google.protobuf import json_format

        sig = self._signature_def()
        return web.json_response({
            "model_spec": {"name": self.model.name, "signature_name": "",
                           "version": str(self.model.version)},
            "metadata": {"signature_def": {"signature_def": {
                "serving_default": json_format.MessageToDict(sig)}}}})

    async def _rest_metrics(self, request):
        from aiohttp import web

        return web.Response(body=self.metrics.render(),
                            content_type="text/plain", charset="utf-8")

    # -- gRPC ------------------------------------------------------------------------

    async def _start_grpc(self):
        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
            _PredictionService(self), server)
        port = server.add_insecure_port(f"{self.host}:{self.grpc_port}")
        if not port:
            raise OSError(f"kvcoll serve: cannot listen for gRPC on {self.host}:"
                          f"{self.grpc_port}")
        await server.start()
        self._grpc, self.grpc_port = server, port

    def _signature_def(self):
        import tensorflow as tf
        from tensorflow.core.protobuf import meta_graph_pb2

        sig = self.model.sig
        out = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
        for name, e in sig.inputs.items():
            info = out.inputs[name]
            info.name = name
            if e["kind"] == "ids":
                info.dtype = (tf.string if e["string"] else tf.int64).as_datatype_enum
                shape = [-1, -1] if e["multi_hot"] else [-1]
            else:
                info.dtype = tf.as_dtype(e["dtype"]).as_datatype_enum
                shape = [-1 if d is None else d for d in e["shape"]]
            for d in shape:
                info.tensor_shape.dim.add(size=d)
        for name in sig.outputs:
            info = out.outputs[name]
            info.name = name
            info.dtype = tf.float32.as_datatype_enum
            info.tensor_shape.unknown_rank = True
        return out


def _loads(text: str):
    import json

    return json.loads(text)


def _grpc_service_base():
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    return prediction_service_pb2_grpc.PredictionServiceServicer


class _PredictionService(_grpc_service_base()):
    def __init__(self, server: Server):
        self.server = server

    async def Predict(self, request, context):  # noqa: N802 - the gRPC method's name
        import grpc
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2

        srv = self.server
        t0 = time.perf_counter()
        code = "OK"
        try:
            err = srv._check_name(request.model_spec.name)
            if err:
                code = "NOT_FOUND"
                await context.abort(grpc.StatusCode.NOT_FOUND, err)
            if request.model_spec.signature_name not in ("", "serving_default"):
                code = "INVALID_ARGUMENT"
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"signature {request.model_spec.signature_name!r} is "
                                    "not found; this model has 'serving_default'")
            try:
                arrays = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
            except Exception as exc:  # noqa: BLE001 - a malformed TensorProto
                raise BadRequest(f"an input is not a valid TensorProto ({exc})") from None
            out, version = await srv.predict(arrays, "grpc")
            wanted = set(request.output_filter) or None
            bad = sorted((wanted or set()) - set(srv.model.sig.outputs))
            if bad:
                raise BadRequest(f"output_filter names {bad}, not outputs of the model "
                                 f"({srv.model.sig.outputs})")
            resp = predict_pb2.PredictResponse()
            resp.model_spec.name = srv.model.name
            resp.model_spec.signature_name = "serving_default"
            resp.model_spec.version.value = version
            for k, v in out.items():
                if wanted is None or k in wanted:
                    resp.outputs[k].CopyFrom(tf.make_tensor_proto(np.ascontiguousarray(v)))
            return resp
        except BadRequest as exc:
            code = "INVALID_ARGUMENT"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the server keeps serving
            if isinstance(exc, grpc.aio.AbortError):
                raise
            code = "INTERNAL"
            log.exception("kvcoll serve: a gRPC request failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            srv.metrics.latency.labels("grpc").observe(time.perf_counter() - t0)
            srv.metrics.requests.labels("grpc", code).inc()

    async def GetModelMetadata(self, request, context):  # noqa: N802
        import grpc
        from tensorflow_serving.apis import get_model_metadata_pb2

        srv = self.server
        err = srv._check_name(request.model_spec.name)
        if err:
            await context.abort(grpc.StatusCode.NOT_FOUND, err)
        fields = list(request.metadata_field)
        if fields != ["signature_def"]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"metadata_field must be ['signature_def'], got {fields}")
        resp = get_model_metadata_pb2.GetModelMetadataResponse()
        resp.model_spec.name = srv.model.name
        resp.model_spec.version.value = srv.model.version
        sigmap = get_model_metadata_pb2.SignatureDefMap()
        sigmap.signature_def["serving_default"].CopyFrom(srv._signature_def())
        resp.metadata["signature_def"].Pack(sigmap)
        return resp
