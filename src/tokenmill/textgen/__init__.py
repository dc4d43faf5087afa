"""What the wire, the frontend and the engine share about generating text from a checkpoint:
sampling parameters, per-step outputs and finish reasons, the tokenizer and chat template, the
checkpoint's config.json. A leaf package, torch-free: a frontend or router host imports it and
never the engine."""
