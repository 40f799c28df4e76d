"""The HTTP server: ``app.create_app`` (the app factory), the OpenAI and admin routes, errors
in OpenAI's shape, the API key. docs/server.md and docs/api.md describe it."""
