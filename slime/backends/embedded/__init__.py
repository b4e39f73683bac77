"""The embedded rollout engine: SGLang's HTTP protocol served by a transformers causal LM.

    engine = EmbeddedEngine(EngineConfig(model_path=ckpt))
    server = EngineHTTPServer(engine, token="...", port=0); server.start_in_thread()
    # or: python -m slime.backends.embedded --model-path ckpt --port 30000
"""

from slime.backends.embedded.engine import EmbeddedEngine, EngineConfig, Request
from slime.backends.embedded.server import EngineHTTPServer

__all__ = ["EmbeddedEngine", "EngineConfig", "EngineHTTPServer", "Request"]
