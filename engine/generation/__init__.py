"""alignopsd.engine.generation"""
