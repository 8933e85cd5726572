"""Data for training: byte-level text, synthetic sequence tasks, procedural 3D volumes.

Every batch is a pure function of (seed, step) (or (seed, index) for evaluation), so a run that
stops and resumes from step s sees exactly the batches an uninterrupted run sees.
"""
