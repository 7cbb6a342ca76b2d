"""cleave.kv"""
