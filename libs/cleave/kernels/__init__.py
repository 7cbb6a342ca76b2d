"""cleave.kernels"""
