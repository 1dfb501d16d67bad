"""ChatTTS engine: loading, random checkpoints, batched generation, streaming decode."""
