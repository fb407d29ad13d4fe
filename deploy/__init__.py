"""Deployment: the command line, and (later) the Ray Serve application and batch job."""
