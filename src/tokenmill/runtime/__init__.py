"""tokenmill.runtime"""
