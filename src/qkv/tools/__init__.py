"""Tools over the engine and the core: the engine's measurements (``qkv.bench``), the accuracy oracle and its
table (``qkv.accuracy``, ``qkv.accuracy_table``) and the lab's experiments proving the seeds' claims
(``qkv.lab``).
"""
