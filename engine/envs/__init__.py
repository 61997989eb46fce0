"""alignopsd.engine.envs"""
