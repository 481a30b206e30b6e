"""Dashboard pages: each module is a Streamlit page script run by ``app/main.py`` through st.navigation."""
