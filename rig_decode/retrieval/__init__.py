from .base import Document, Hit, RetrievalError, Retriever

__all__ = ["Document", "Hit", "RetrievalError", "Retriever"]
