"""The core: the support table, the wire codec, sampling with capture, penalties and logit bias,
log-probabilities, their parallel forms and the losses. It imports torch, numpy and
``support_replay.errors`` alone (no HTTP, no engine, no trainer, no run config); everything
above it uses the same functions, so the engine's log mu and the trainer's log pi are one
computation."""
