"""qpipe: quantization and accuracy-recovery pipeline for LLM serving.

Data flows one way: recipe -> checkpoint -> served endpoint -> measurements -> MLflow.
"""

__version__ = "0.1.0"
