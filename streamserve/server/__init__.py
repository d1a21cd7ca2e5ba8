"""The HTTP server: OpenAI-compatible routes over aiohttp."""
