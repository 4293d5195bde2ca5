"""What a request used: tokens read from the answer's bytes, the usage event taken out, the
hourly usage book, and the request's record (its log line).
"""
