"""kvtier.tools.policysim: `kvtier replay --simulate`, policies replayed on traces without
engines: hit rates against `belady`, the online bound and an infinite cache.
"""
