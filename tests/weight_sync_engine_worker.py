"""`python tests/weight_sync_engine_worker.py MODE`: a stand-in engine process for the distributed weight-sync
tests. It serves SGLang's control and weight endpoints on 127.0.0.1 (port printed first), joins the
weight-update group with slime.utils.distributed (as the embedded engine does) and, per MODE:
`receive` takes every broadcast; `refuse` answers /update_weights_from_distributed with HTTP 400 at once,
without joining the broadcast (as a real SGLang server may) and keeps its group until told to destroy it.
GET /calls lists the endpoints called, with "update_done" once an update call has returned."""

from __future__ import annotations

import sys

import torch

from json_http import JsonHandler, serve
from slime.utils.distributed import broadcast, destroy_custom_process_group, init_custom_process_group

MODE = sys.argv[1]
calls: list[str] = []
groups: dict[str, object] = {}


class Handler(JsonHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.reply(200, {"calls": list(calls)} if self.path == "/calls" else {"model_path": "stand-in"})

    def do_POST(self):
        body = self.body()
        calls.append(self.path)
        if self.path == "/init_weights_update_group":
            groups[body["group_name"]] = init_custom_process_group(
                body["master_address"], body["master_port"], body["world_size"], body["rank_offset"],
                body["group_name"], backend=body.get("backend"), timeout_s=300)
        elif self.path == "/destroy_weights_update_group":
            g = groups.pop(body["group_name"], None)
            if g is not None:
                destroy_custom_process_group(g)
        elif self.path == "/update_weights_from_distributed":
            if MODE == "refuse":
                calls.append("update_done")
                return self.reply(400, {"success": False, "message": "refusing: weights are locked"})
            try:
                for shape, dt in zip(body["shapes"], body["dtypes"]):
                    broadcast(torch.empty(shape, dtype=getattr(torch, dt)), src=0, group=groups[body["group_name"]])
            except Exception as e:  # the sender aborted the group
                calls.append("update_done")
                return self.reply(400, {"success": False, "message": f"broadcast failed: {type(e).__name__}"})
            calls.append("update_done")
        self.reply(200, {"success": True, "message": ""})


server, _ = serve(Handler)
print(server.server_address[1], flush=True)
sys.stdin.read()  # until the test closes stdin
