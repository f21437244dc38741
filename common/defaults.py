"""Names every layer may import: a leaf module (it imports nothing, so the launcher can read
them without loading torch, and the model layer without loading the cluster's config)."""

EMBEDDED_MODEL_NAME = "pdserve-tiny"  # the name the embedded tiny model is served under
