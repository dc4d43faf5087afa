"""tokenmill.bench"""
