"""cleave.engine"""
