"""Text handling before speech: sentence segmentation and spoken-form normalization."""
