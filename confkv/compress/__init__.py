"""Scoring, the value predictor, tier plans and the byte budget: what the compressor decides between
steps; the library API beside them."""
