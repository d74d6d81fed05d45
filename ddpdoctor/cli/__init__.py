"""Command-line front end: ``ddpdoctor demo|report|watch``."""
