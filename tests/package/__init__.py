"""drain-outbox as built and installed: the wheel and sdist, in a clean venv."""
