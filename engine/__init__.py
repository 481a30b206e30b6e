"""The embedded speculative engine: proposers, acceptance rules, the live loop and teacher-forced replay."""
