from .base import Document, Hit, HitList, RetrievalError, Retriever

__all__ = ["Document", "Hit", "HitList", "RetrievalError", "Retriever"]
