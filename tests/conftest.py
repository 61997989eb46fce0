"""Shared by every test area: this folder is on ``sys.path`` (pytest's default import mode inserts a conftest's
folder), so ``selection_oracle`` -- the one test oracle of the source selection -- imports from any area."""
