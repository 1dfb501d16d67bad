"""Everything that makes and sends speech: text, TTS engines, audio buffers, the Opus track."""
