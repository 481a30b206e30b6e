"""`dflash-doctor replay`: run only the engine and write a run directory (filled in by the engine issue)."""
