"""cleave.rpc"""
