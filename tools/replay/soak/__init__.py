"""kvtier.tools.replay.soak: `kvtier replay --soak`, the replay under injected faults (master
kills, crashes, corrupt files), checked for wrong blocks and failed requests.
"""
