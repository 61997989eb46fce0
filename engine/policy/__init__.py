"""alignopsd.engine.policy"""
