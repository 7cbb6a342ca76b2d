"""cleave.proto"""
