"""tokenmill.kv"""
