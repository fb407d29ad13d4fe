"""The ingress: the OpenAI-compatible API, admission and routing, on Ray Serve or in process."""
