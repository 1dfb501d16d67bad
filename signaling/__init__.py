"""The aiohttp signaling server: routes, SDP offer/answer, sessions, static files."""
