"""The HTTP layer: FastAPI routes only; all decisions live in ``hangar.core``."""
