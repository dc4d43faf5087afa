"""`tokenmill frontend`."""
from tokenmill.frontend.serve_cli import add_frontend_arguments as add_arguments
from tokenmill.frontend.serve_cli import run_frontend as run

__all__ = ["add_arguments", "run"]
