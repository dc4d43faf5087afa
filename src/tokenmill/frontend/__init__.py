"""tokenmill.frontend"""
