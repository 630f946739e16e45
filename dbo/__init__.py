"""dbo: the ubatch runtime for Dual Batch Overlap."""
