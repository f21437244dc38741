"""Names every layer may import: a leaf module (it imports nothing, so the launcher can read
them without loading torch, and the model layer without loading the cluster's config)."""

EMBEDDED_MODEL_NAME = "pdserve-tiny"  # the name the embedded tiny model is served under
EMBEDDED_MODEL_SPEC = "embedded"  # --model embedded: the tiny random model pdserve generates
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # served when --model is not given (common/model/sources.py)
DEFAULT_CACHE_DIR = "~/.cache/pdserve"  # --cache-dir: downloads, converted GGUF files, the embedded model
MAX_HEARTBEAT_INTERVAL_S = 60.0  # so a node is evicted at most ~3 minutes after it goes silent (registry_client)
