"""Past one machine: elbowroom over a Ray cluster (docs/cluster.md).

The pure parts (``placement``, ``pressure``, ``split``, ``rpc``) import nothing from Ray;
``agent`` and ``remote`` do, and are only imported when ``Settings.cluster`` is set.
"""
