"""OpenAI-compatible HTTP server: protocol schemas, the async engine loop, the FastAPI app.

`astrai serve --model DIR` runs `astrai.serve.cli.main`; `create_app(ServeConfig(...))` builds the
same app for embedding or tests.
"""
