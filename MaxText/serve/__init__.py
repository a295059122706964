"""An OpenAI-compatible server over the decoding engine, with continuous batching
(`python -m MaxText.serve`, __main__.py). One concern per module: protocol.py (request bodies and
their checks), errors.py (error answers), guard.py (API key, body size), scheduler.py (the engine
thread and its slots), text.py (a completion's text and stop strings as tokens arrive),
responses.py (the OpenAI answers and stream chunks), metrics.py (Prometheus), app.py (the routes).
The compiled programs of the slots are MaxText/decoding/slots.py."""
