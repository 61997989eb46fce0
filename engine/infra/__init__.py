"""Infrastructure every layer may use: write failures named with their file, and the engine's cache folders."""
