"""The speech plane on Ray Serve: ChatTTS replicas on GPU workers, streamed to media processes."""
