"""`tokenmill serve`."""
from tokenmill.frontend.serve_cli import add_serve_arguments as add_arguments
from tokenmill.frontend.serve_cli import run_serve as run

__all__ = ["add_arguments", "run"]
