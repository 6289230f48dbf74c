"""The two byte units, each defined once.

``GIB`` (2^30) is the unit of every memory setting a user gives (``--max-vram``, ``--max-ram``, ``--reserve``,
``--expert-cache`` and their ``EngineConfig`` fields ``*_gb``): a card sold as "16 GB" has 16 GiB.
``GB`` (10^9) is only for reporting (sizes and bandwidths in GB/s, as disks and links are quoted).
"""

GIB = 1 << 30
GB = 10**9
