"""Tools that need torch: diff two checkpoints, export to Hugging Face safetensors.

They stream tensors through the reader under a memory bound.
"""
