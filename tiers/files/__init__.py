"""kvtier.tiers.files: what the file tiers (nvme, sharedfs) share: tier directories, aligned and
bounce buffers, and the helpers of their checks.
"""
