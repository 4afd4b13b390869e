"""FastAPI service over the exported model (models/merged by default): the `uvicorn agentrl.serve:app` entry.

    make serve                      # uvicorn agentrl.serve:app on 127.0.0.1:8000
    make serve PORT=8123 MODEL=models/merged

AGENTRL_MODEL_PATH names the model directory (else serve.model_path), AGENTRL_PARAMS the params file (else
params.yaml). The server itself is the agentrl.serving package: routes in serving/app.py, the batching engine
in serving/engine.py, streaming in serving/streaming.py (its __init__ maps every part).
"""

from .serving.app import app

__all__ = ["app"]
