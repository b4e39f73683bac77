"""HTTP front of the embedded engine: SGLang's endpoints (stdlib ThreadingHTTPServer) on 127.0.0.1, or the
node's address in a multi-node run (slime.utils.net.bind_host).

Weight, memory and scheduling-control endpoints need `Authorization: Bearer <token>` (the run's
token; SGLang's `--api-key` uses the same header). Malformed requests get HTTP 400 with
`{"error": {"message": ...}}` (generation) or `{"success": false, "message": ...}` (control),
one line naming the problem; the server keeps serving.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from slime.accelerator import get_accelerator
from slime.accelerator.ipc import UnsafeHandleError, deserialize_named_tensors
from slime.backends.embedded.engine import EmbeddedEngine
from slime.backends.embedded.errors import BadRequest, NotFound, Unauthorized

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
MAX_BODY_BYTES = 1 << 30

# Endpoints that change weights, memory or scheduling for every client.
PROTECTED = {
    "/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weights_from_disk",
    "/init_weights_update_group", "/destroy_weights_update_group", "/release_memory_occupation",
    "/resume_memory_occupation", "/pause_generation", "/continue_generation", "/abort_request",
    "/weight_sets_layout", "/attach_weight_sets", "/weight_sets_state", "/commit_weight_sets",
}


class EngineHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # socketserver's default backlog of 5 resets bursts of concurrent clients

    def __init__(self, engine: EmbeddedEngine | None, token: str, port: int = 0, host: str = HOST) -> None:
        """`engine` may be attached later (bind the port first, then load the model): until then every
        endpoint answers 503, so /health pollers keep waiting."""
        if not token:
            raise ValueError("the engine server needs a non-empty token")
        self.engine = engine
        self.token = token
        self.host = host
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="embedded-engine-http", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self.engine is not None:
            self.engine.shutdown()


class _Handler(BaseHTTPRequestHandler):
    server: EngineHTTPServer
    protocol_version = "HTTP/1.1"  # clients keep the connection between requests (slime.utils.http_client)
    # TCP_NODELAY: a reply is two writes (headers, body); on a kept-alive connection Nagle's algorithm would hold
    # the body until the client's delayed ACK of the headers (~40 ms a request, measured: 45 ms vs 0.19 ms)
    disable_nagle_algorithm = True

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs through logging (quiet by default)
        logger.debug("%s - %s", self.address_string(), fmt % args)

    # -------------------------------------------------------------- plumbing
    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _send(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (timeout); nothing to answer

    def _body(self) -> dict[str, Any]:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise BadRequest("Content-Length is not a number") from None
        if n < 0:
            raise BadRequest("Content-Length is negative")
        if n > MAX_BODY_BYTES:
            raise BadRequest(f"request body of {n} bytes exceeds {MAX_BODY_BYTES}")
        raw = self.rfile.read(n) if n else b""
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not valid JSON: {e.msg if hasattr(e, 'msg') else e}") from e
        if not isinstance(obj, dict):
            raise BadRequest("body must be a JSON object")
        return obj

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        return hmac.compare_digest(given.encode(), self.server.token.encode())

    def _dispatch(self) -> None:
        path = self.path.split("?", 1)[0]
        route = _ROUTES.get(path)
        generation = path == "/generate"
        try:
            # Read the body first so keep-alive connections stay in sync even on errors.
            body = self._body() if self.command == "POST" or self.headers.get("Content-Length") else {}
            if route is None:
                raise NotFound(f"no endpoint {path}")
            if self.server.engine is None:
                self._send(503, {"success": False, "message": "the engine is still loading the model"})
                return
            if path in PROTECTED and not self._authorized():
                raise Unauthorized(f"{path} needs the run's token: send header 'Authorization: Bearer <token>'")
            status, result = route(self.server.engine, body)
            self._send(status, result)
        except (BadRequest, Unauthorized, NotFound) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            self._send(e.status, {"error": {"message": msg, "code": e.status}} if generation
                       else {"success": False, "message": msg})
        except Exception as e:  # keep serving; report one line
            logger.exception("error serving %s", path)
            msg = f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._send(500, {"error": {"message": msg, "code": 500}} if generation else {"success": False, "message": msg})


# ------------------------------------------------------------------ endpoints
def _ok(message: str = "ok", **extra: Any) -> tuple[int, dict[str, Any]]:
    return 200, {"success": True, "message": message, **extra}


def _health(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    return 200, {"status": "ok", "weight_version": engine.weight_version, **engine.load(), "stats": dict(engine.stats)}


def _generate(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    if body.get("custom_logit_processor"):
        raise BadRequest("custom_logit_processor is not supported by the embedded engine (it runs no custom logit "
                         "processors); drop it, or use an SGLang engine started with --enable-custom-logit-processor")
    input_ids, text = body.get("input_ids"), body.get("text")
    if input_ids is None and text is None:
        raise BadRequest("send input_ids (list of ints, or list of lists for a batch) or text")
    batch = (isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)) or isinstance(text, list)
    if not batch:
        req = engine.make_request(input_ids, body.get("sampling_params"), body.get("return_logprob", False),
                                  body.get("rid"), text, body.get("return_routed_experts", False),
                                  body.get("routed_experts_start_len", 0), body.get("return_indexer_topk", False))
        engine.submit(req).done.wait()
        return 200, engine.response(req)
    items = input_ids if input_ids is not None else text
    n = len(items)

    def per_item(key: str, default: Any) -> list[Any]:
        v = body.get(key, default)
        if isinstance(v, list):
            if len(v) != n:
                raise BadRequest(f"{key} has {len(v)} entries for a batch of {n}")
            return v
        return [None if key == "rid" else v] * n

    params, logprob, rids = per_item("sampling_params", None), per_item("return_logprob", False), per_item("rid", None)
    params = _item_seeds(params, body.get("sampling_params"))
    routed, starts = per_item("return_routed_experts", False), per_item("routed_experts_start_len", 0)
    keys = per_item("return_indexer_topk", False)
    reqs = [engine.make_request(items[i] if input_ids is not None else None, params[i], logprob[i], rids[i],
                                items[i] if input_ids is None else None, routed[i], starts[i], keys[i])
            for i in range(n)]
    engine.submit_batch(reqs)  # all validated before any is queued; queued at once (one wave, no gather wait)
    for r in reqs:
        r.done.wait()
    return 200, [engine.response(r) for r in reqs]


def _item_seeds(params: list[Any], shared: Any) -> list[Any]:
    """One sampling_params object for a whole batch with a sampling_seed s: item i samples with seed s + i. A
    client that sends each sample its own seed (s, s + 1, ... for consecutive samples, as slime's rollout
    does) can then batch through sglang-router, which forwards one sampling_params object per request; SGLang
    would give every item seed s, i.e. one prompt's samples all alike (a GRPO group collapsed)."""
    if not isinstance(shared, dict) or isinstance(shared.get("sampling_seed"), bool) \
            or not isinstance(shared.get("sampling_seed"), int):
        return params
    return [{**shared, "sampling_seed": shared["sampling_seed"] + i} for i in range(len(params))]


def _model_info(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    return 200, engine.model_info()


def _flush_cache(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    return _ok("no prefix cache is kept between waves")


def _pause(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    engine.pause(body.get("mode", "abort"))
    return _ok("paused")


def _continue(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    engine.resume()
    return _ok("continued")


def _abort(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    if body.get("abort_all") or not body.get("rid"):
        n = engine.abort_all("aborted by abort_request")
        return _ok(f"aborted all ({n} queued)")
    return _ok("aborted" if engine.abort_request(str(body["rid"])) else "no queued request with that rid")


def _release(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    engine.release_memory(body.get("tags"))
    return _ok("released")


def _resume_memory(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    engine.resume_memory(body.get("tags"))
    return _ok("resumed")


def _decode_named_tensors(body: dict, tp: int = 1) -> list[tuple[str, Any]]:
    from slime.accelerator.ipc import deserialize_flattened_bucket
    from slime.backends.embedded.flattened_bucket import unflatten

    payload = body.get("serialized_named_tensors")
    if not isinstance(payload, list) or not payload or not all(isinstance(s, str) for s in payload):
        raise BadRequest("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
    if len(payload) != tp:
        raise BadRequest(f"this engine has tp_size {tp} but serialized_named_tensors has {len(payload)} entries")
    # TP rank 0 opens its own entry (its node's buffers) and broadcasts the result to the other ranks
    # (tensor_parallel.py): entries 1.. point at other nodes' memory and are not opened here
    fmt = body.get("load_format")
    if fmt not in (None, "direct", "auto", "flattened_bucket"):
        raise BadRequest(f"load_format {fmt!r} is not supported; use null or \"flattened_bucket\"")
    try:
        data = base64.b64decode(payload[0], validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"serialized_named_tensors[0] is not valid base64: {e}") from e
    allowed = get_accelerator().ipc_rebuild_allowlist()
    try:
        if fmt == "flattened_bucket":
            return unflatten(*deserialize_flattened_bucket(data, allowed))
        return deserialize_named_tensors(data, allowed)
    except BadRequest:
        raise
    except UnsafeHandleError as e:
        raise BadRequest(f"refused tensor payload: {e}") from e
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, RuntimeError, OSError) as e:
        raise BadRequest(f"cannot open tensor payload ({type(e).__name__}: {e}); build it with SGLang's "
                         "MultiprocessingSerializer or slime.accelerator.ipc") from e


def _update_from_tensor(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    named = _decode_named_tensors(body, getattr(engine, "tp_size", 1))
    extra = {}
    if body.get("return_checksums"):  # slime's check of this update, without a /get_weights_checksum round trip
        n, extra["checksums"] = engine.update_from_named_tensors_checked(named, body.get("weight_version"))
    else:
        n = engine.update_from_named_tensors(named, body.get("weight_version"))
    return _ok(f"updated {n} weights", weight_version=engine.weight_version, **extra)


def _weight_sets_layout(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    return _ok("layout", **engine.weight_sets_layout(body.get("expert_layout", "hf")))


def _attach_weight_sets(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    """Two shared uint8 buffers (one serialize_named_tensors payload) that become the engine's weight sets."""
    named = _decode_named_tensors({"serialized_named_tensors": body.get("serialized_named_tensors")}, 1)
    return _ok("attached", **engine.attach_weight_sets(body.get("layout_id"), [t for _, t in named]))


def _weight_sets_state(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    return _ok("state", **engine.weight_sets_state(body.get("layout_id")))


def _commit_weight_sets(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    out = engine.commit_weight_sets(body.get("layout_id"), body.get("epoch"), body.get("names"),
                                    body.get("weight_version"), body.get("checksums"),
                                    bool(body.get("return_checksums")))
    return _ok(f"updated {out['updated']} weights", weight_version=engine.weight_version, **out)


def _update_from_disk(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    n = engine.update_from_disk(body.get("model_path"), body.get("weight_version"))
    return _ok(f"loaded {n} weights from {body.get('model_path')}", weight_version=engine.weight_version)


def _init_group(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size", "group_name") if k not in body]
    if missing:
        raise BadRequest(f"init_weights_update_group is missing {missing}")
    engine.init_weights_update_group(body["master_address"], body["master_port"], body["rank_offset"],
                                     body["world_size"], body["group_name"], body.get("backend"))
    return _ok(f"joined group {body['group_name']}")


def _update_from_distributed(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    n = engine.update_from_distributed(body.get("names"), body.get("dtypes"), body.get("shapes"),
                                       body.get("group_name", "weight_update_group"), body.get("weight_version"),
                                       body.get("load_format"), body.get("sequence"))
    return _ok(f"updated {n} weights", weight_version=engine.weight_version)


def _weights_by_name(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    """SGLang's /get_weights_by_name: the parameter as float32 nested lists, its first dimension cut to
    `truncate_size` rows (SGLang: `param.cpu().to(torch.float32).numpy().tolist()[:truncate_size]`)."""
    name, size = body.get("name"), body.get("truncate_size", 100)
    if not isinstance(name, str) or not name:
        raise BadRequest("get_weights_by_name needs name: the parameter's name")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadRequest(f"truncate_size must be a non-negative int, got {size!r}")
    return 200, engine.weights_by_name(name, size)


def _weights_checksum(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    return _ok("checksums", checksums=engine.weights_checksum(body.get("names")))


def _destroy_group(engine: EmbeddedEngine, body: dict) -> tuple[int, Any]:
    engine.destroy_weights_update_group(body.get("group_name", "weight_update_group"))
    return _ok("destroyed")


_ROUTES: dict[str, Callable[[EmbeddedEngine, dict], tuple[int, Any]]] = {
    "/health": _health,
    "/health_generate": _health,
    "/generate": _generate,
    "/get_model_info": _model_info,
    "/model_info": _model_info,  # the names sglang-router probes first
    "/server_info": _model_info,
    "/get_server_info": _model_info,
    "/flush_cache": _flush_cache,
    "/pause_generation": _pause,
    "/continue_generation": _continue,
    "/abort_request": _abort,
    "/release_memory_occupation": _release,
    "/resume_memory_occupation": _resume_memory,
    "/update_weights_from_tensor": _update_from_tensor,
    "/update_weights_from_disk": _update_from_disk,
    "/weight_sets_layout": _weight_sets_layout,
    "/attach_weight_sets": _attach_weight_sets,
    "/weight_sets_state": _weight_sets_state,
    "/commit_weight_sets": _commit_weight_sets,
    "/init_weights_update_group": _init_group,
    "/update_weights_from_distributed": _update_from_distributed,
    "/destroy_weights_update_group": _destroy_group,
    "/get_weights_checksum": _weights_checksum,
    "/get_weights_by_name": _weights_by_name,
}
